"""The device's rules: what a GPU (or the CPU) runs for an op and what it holds: kernel rules as data
(`targets`), GPU capacities (`gpus`), the roofline cost model (`cost`), GPU kernels emulated on
fake tensors (`emulate`), the CUDA caching allocator (`allocator`), oneDNN's scratch
(`kernel_scratch`). Imports only remat's base (graph, errors, units, quiet)."""
