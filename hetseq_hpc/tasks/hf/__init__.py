"""``task=hf``: Hugging Face transformers models from local files (docs/tasks.md)."""
