"""Triton kernels of the runtime's decode path: attention, the fused decode ops and the decode GEMVs.

Each op module (attention, fused, gemv) imports its *_triton kernel module inside the launcher, so the
package imports without triton (CPU runs take the torch references)."""
