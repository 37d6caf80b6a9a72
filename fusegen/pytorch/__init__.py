"""PyTorch integration: autograd, torch.func, torch.compile, DTensor, ONNX."""
