"""The device kinds a run can name (``device_kind``) and what the time plan prices them at: the
dense bf16 peak, no sparsity, from NVIDIA's H100 SXM5 and H200 SXM datasheets (1,979 TFLOPS "with
sparsity", half of it dense; the H200 is the H100's compute with more memory)."""

DEVICE_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}
DEFAULT_DEVICE = "H100"
