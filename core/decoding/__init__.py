"""The decoding wing: a trained model as it generates.

decode (inference_model, sampling, the context window's rule, generate and generate_stream); cache (RowCache: the
KV cache with each row at its own position, for the server's batch).
"""
