"""The FFN side: an FFN rank's routed experts (weights), their kernels, and its serve loop."""
