"""CPU kernels: quantisation onto the int4/int5/int8 grids, the compiled grouped kernels (csrc/), GGUF block
decoding, and float32 oneDNN linears."""
