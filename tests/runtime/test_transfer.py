"""Weights to the device in pinned pieces on threads (`transfer.upload`): on the CPU its staged path (the same
pieces, buffers and threads, without pinned memory or streams) must give every tensor back bit for bit."""
import torch

from llmc.runtime.transfer import upload


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300, 70, generator=g).to(torch.bfloat16),  # 42,000 bytes: many 4 KiB pieces
        "fp32": torch.randn(1000, generator=g),
        "int8": torch.randint(-128, 127, (33, 17), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 8),
        "strided": torch.randn(64, 32, generator=g).t(),  # not contiguous: copied as it is
        "odd": torch.randint(0, 2**31, (4097,), dtype=torch.int32, generator=g),  # a piece that ends mid-buffer
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_staged_upload_gives_every_tensor_back_bit_for_bit():
    w = _weights()
    for threads in (1, 3):
        got = upload(w, torch.device("cpu"), threads=threads, chunk=4096, staged=True)
        assert list(got) == list(w)
        for name, t in w.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(_bits(got[name]), _bits(t)), name
            if t.is_contiguous() and t.numel():  # staged: a copy (a strided one goes by `.to`, as before)
                assert got[name].data_ptr() != t.data_ptr(), name


def test_a_mapped_weights_file_uploads_as_loaded(tmp_path):
    """The engine's case: tensors mapped from a safetensors file."""
    from safetensors.torch import load_file, save_file
    w = {k: v.contiguous() for k, v in _weights().items()}
    save_file(w, str(tmp_path / "w.safetensors"))
    mapped = load_file(str(tmp_path / "w.safetensors"))
    got = upload(mapped, torch.device("cpu"), threads=2, chunk=8192, staged=True)
    assert all(torch.equal(_bits(got[k]), _bits(w[k])) for k in w)
