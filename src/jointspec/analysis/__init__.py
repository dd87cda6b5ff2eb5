"""Research analysis: perplexity and text-quality metrics, exact multi-token joint distributions on tiny models."""
