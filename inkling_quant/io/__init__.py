"""Reading and writing checkpoints, streaming and validated."""
