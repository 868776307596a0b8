"""The tools around the package: the command line, the benchmarks and the reliability
harness. No layer imports them; ``python -m onnx_offload`` runs the command line.
"""
