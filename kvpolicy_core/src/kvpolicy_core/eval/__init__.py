"""Evaluation: perplexity with a bounded cache, paired comparisons, and the retrieval tasks."""
