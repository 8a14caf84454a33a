"""HuggingFace exports: the Saver (when and where) and the collective export job (how a folder is written and published)."""
