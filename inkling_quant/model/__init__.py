"""What a checkpoint is, with no number format and no torch op: its tensors (names, parts, specs),
the configs that describe it (Inkling 2's and the Hugging Face MoE families'), how routed experts
are stored and named, and `layout.detect`, the one classifier of a checkpoint's names."""
