"""Text in and out: the tokenizer, greedy generation, perplexity."""
