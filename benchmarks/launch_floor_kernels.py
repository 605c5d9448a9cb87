"""Two trivial Triton kernels for ``host_phases.py``'s launch floor: one pointer, and one pointer with
31 ints (a parameter list as long as the split kernel's), each storing one value."""
import triton
import triton.language as tl


@triton.jit
def store_one(x):
    tl.store(x, 1.0)


@triton.jit
def store_sum(x, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22,
              a23, a24, a25, a26, a27, a28, a29, a30, a31):
    tl.store(x, (a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17 + a18
                 + a19 + a20 + a21 + a22 + a23 + a24 + a25 + a26 + a27 + a28 + a29 + a30 + a31) * 1.0)
