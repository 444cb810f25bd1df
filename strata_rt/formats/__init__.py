"""The format contract, the plugin registry and its hooks, activation encodings, the launchers every
format shares, and the conformance suite for format plugins."""
