"""torch's private fast paths (flashdecode.compat) against their public fallbacks."""
import pytest
import torch

from flashdecode import compat


@pytest.mark.gpu
def test_torch_still_has_the_fast_stream_handle():
    """(A CUDA build of torch.) Fails when torch drops torch._C._cuda_getCurrentRawStream: the fallback then runs, slower."""
    assert compat.has_fast_stream_handle()


def test_not_compiling_in_eager_code():
    assert compat.is_compiling() is False


@pytest.mark.gpu
def test_fast_stream_handle_matches_the_public_one():
    assert compat.current_stream_handle(0) == compat.public_stream_handle(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert compat.current_stream_handle(0) == compat.public_stream_handle(0) == side.cuda_stream
