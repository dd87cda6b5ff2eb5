"""Trained drafts bound to a target: EAGLE-style heads, Medusa, Hydra, distilled draft models, and their artifact
format."""
