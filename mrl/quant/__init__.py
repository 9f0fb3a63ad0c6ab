"""Weight quantisation formats, pure torch: DeepSeek-V3's block-scaled FP8 (fp8.py)."""
