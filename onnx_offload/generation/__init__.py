"""Token-by-token generation with the KV cache on the device: the KV caches of each
export layout, sampling, and the generation's steps at fixed shapes and addresses.
"""
