"""Accuracy: real data fetched offline, perplexity and multiple-choice scoring of any stage's model."""
