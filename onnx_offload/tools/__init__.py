"""The tools around the package: the command line, the benchmarks and the reliability
harness. Nothing in the package imports them.
"""
