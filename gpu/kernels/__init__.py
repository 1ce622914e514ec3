"""C and Triton kernels, a step's host tensors, CPU runtime settings; import nothing of gpu."""
