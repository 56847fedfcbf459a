"""Public ops, each registered as a torch.library custom op with a fake implementation."""
