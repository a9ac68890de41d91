"""Kernels: Triton (CUDA) and the C block kernel (CPU). They know tensors and shapes, no modules."""
