"""Phase 2, quantization: each method's algorithm as pure tensor functions (`gptq`, `awq`,
`smoothquant`), beside the passes that read calibration statistics from the graph and apply them.

Every method ends in a `llmc.ir.quant.QuantizedWeight`, so what a method produces is a format the
kernels already know, and each algorithm is tested on plain tensors without building a graph.
"""
