"""The model layer: a path or bytes becomes a prepared model.

The model is materialized where ORT would read it (its external data checked by ORT's
rules), optimized once for the target provider, cached under a key of its content, and
read as a weights table; the segmenter splits it where the weights must stream.
``pipeline.prepare`` is the one entry point. Nothing here touches device memory.
"""
