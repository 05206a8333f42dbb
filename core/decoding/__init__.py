"""The decoding wing: a trained model as it generates.

decode (inference_model, sampling, the context window's rule, generate and generate_stream).
"""
