"""The hostile-input fuzzer: seeded mutators of GGUF files, run configs and prompt files, and
the harness that runs each mutated input through the `strata` command and checks what the
README promises for it (exit 1 or 2, or 0 with a correct result; one message naming the input;
no traceback; under 10 s and 1 GiB; no file changed but the named outputs). tests/test_fuzz.py
drives it; `known.py` lists the failures found in code other branches are fixing."""
