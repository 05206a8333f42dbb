"""The decoding wing: a trained model as it generates.

cache.py (RowCache: the KV cache with each row at its own position, for the server's batch; Segments, its rows'
chunks side by side in one forward; StaticCache: the fixed-shape step's), decode.py (inference_model, sampling, the context window's rule, generate and generate_stream,
the fixed-shape step compiled where chosen), quantize.py (--quantize: int8 and int4 products on a CPU), replies.py
(a chat model's replies through the chat template, and their seeds).
"""
