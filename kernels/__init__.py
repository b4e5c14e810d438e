"""CuTe DSL kernels of dit-accel, installed as `dit_accel.kernels`."""
