"""Where a layer's weights come from: the checkpoint readers (a safetensors directory, a GGUF
file) and the stored formats they read (FP8, GPTQ, MLX affine, ggml blocks), dequantized into
plain matrices or kept in a form a kernel multiplies (FP8, int4, MKL-packed)."""
