"""GGUF files (llama.cpp's format) as checkpoints: reading a file's metadata, config and tensors
(`checkpoint`), dequantizing them to float, and serving their matrices at the file's own bits on a
CPU: int4 groups from Q4_0/Q4_1/Q4_K blocks (`blocks`), the embedding read row by row from the
file (`rows`) and the low-bit model built from them (`quantized`). Writing: a GPT as a GGUF file
(`writer`), its tokenizer as the file's metadata (`vocab`).

Kept import-light: nothing is re-exported here; import the modules themselves. The file's
tokenizer is `model.tokenizers.gguf`.
"""
