"""The evaluation wing: a trained model judged, on a whole split, on HellaSwag, or on its answers.

perplexity.py (every token of a split scored once: loss, perplexity, bits per byte), hellaswag.py (the file
read and checked, each example's 4 endings ranked by loss), answers.py (a chat model's exact answers on held-out
conversations, a checked task's exact match and pass@k).
"""
