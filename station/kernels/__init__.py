"""The linear forms and their kernels: dense (oneDNN), quantized, and the C sources with their build."""
