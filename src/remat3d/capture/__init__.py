"""A model's training step as a graph of aten ops (``joint.py``), for graph plans."""
