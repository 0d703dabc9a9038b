"""Paged attention in PyTorch for a CPU, over head-major pools (each (block, head) of the KV pools
one contiguous (block_size, head_dim) tile): decodes read the pools in place (`decode`), prefills
that continue one cached prefix score it once for all of them (`cascade`), and float32 products
go through oneDNN where it runs (`products`). `kernels.backends.CpuPagedBackend` chooses among
them once per step, and `kernels.sdpa_paged` takes the prefills that share nothing.
"""
