"""The turn benchmark (``python -m bench.turns``): replayed agent traces, four
checkpoint policies, side by side on real CRIU, containerd and MinIO."""
