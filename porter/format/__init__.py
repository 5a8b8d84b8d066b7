"""The bottom layer: what porter's files are made of (MXFP8, safetensors, the artifact's names and manifest).

Knows no architecture and no source; everything above may import it.
"""
