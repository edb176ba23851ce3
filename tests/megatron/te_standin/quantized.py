"""Stand-in of TE v2.18's quantizers and quantized storages for MXFP8, FP8 block scaling and NVFP4.

Only what ``distributed``'s quantized gathers read: the usages, ``is_quantizable``,
``make_empty`` and the storage's data / scale-inverse buffers in TE's shapes and dtypes
(``tensor/mxfp8_tensor.py`` ``get_scale_shape``, ``tensor/float8_blockwise_tensor.py``
``get_scale_shape`` with 1x128 blocks, ``tensor/nvfp4_tensor.py``), so the coalesced calls move
the bytes TE's do:

* MXFP8: data ``[M, K]`` uint8 row-wise and column-wise (not transposed); scale-inverses uint8
  ``[ru(M, 128), ru(K / 32, 4)]`` row-wise, ``[ru(M / 32, 4), ru(K, 128)]`` column-wise;
* FP8 block scaling (1x128): data ``[M, K]`` row-wise, ``[K, M]`` column-wise (transposed);
  scale-inverses float32 ``[ceil(K / 128), ru(M, 4)]`` and ``[ceil(M / 128), ru(K, 4)]``;
* NVFP4: two 4-bit values per byte, data ``[M, K / 2]`` row-wise, ``[K, M / 2]`` column-wise;
  scale-inverses uint8 ``[ru(M, 128), ru(K / 16, 4)]`` and ``[ru(K, 128), ru(M / 16, 4)]``.

(``ru(x, n)``: x rounded up to a multiple of n.) Values are not really quantized: a value is
stored as an integer code (0..255, or 0..15 for FP4) and the scale-inverses are ones, so a test
with small integer inputs can check the gathered tensor exactly.
"""

import math

import torch


def ru(x, n):
    return (x + n - 1) // n * n


class QuantizedTensorStorage:
    """TE ``quantized_tensor.QuantizedTensorStorage``: the buffers of one quantized tensor."""

    def __init__(self, shape, dtype, **buffers):
        self._shape, self._dtype = list(shape), dtype
        self._rowwise_data = self._rowwise_scale_inv = None
        self._columnwise_data = self._columnwise_scale_inv = None
        for name, value in buffers.items():
            setattr(self, f"_{name}", value)

    def size(self):
        return torch.Size(self._shape)

    def dequantize(self, dtype=None):
        """The high-precision tensor (from the row-wise codes, else the column-wise ones)."""
        dtype = dtype or self._dtype
        if self._rowwise_data is not None:
            return self._codes(self._rowwise_data, transposed=False).to(dtype)
        return self._codes(self._columnwise_data, transposed=self.COLUMNWISE_TRANSPOSED).to(dtype)

    COLUMNWISE_TRANSPOSED = False

    def _codes(self, data, *, transposed):
        return data.t() if transposed else data


class MXFP8TensorStorage(QuantizedTensorStorage):
    pass


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    COLUMNWISE_TRANSPOSED = True


class NVFP4TensorStorage(QuantizedTensorStorage):
    COLUMNWISE_TRANSPOSED = True

    def __init__(self, shape, dtype, **buffers):
        self._amax_rowwise = self._amax_columnwise = None
        super().__init__(shape, dtype, **buffers)

    def _codes(self, data, *, transposed):
        unpacked = torch.stack([data & 15, data >> 4], dim=-1).reshape(data.shape[0], -1)
        return unpacked.t() if transposed else unpacked


class Quantizer:
    """TE ``quantized_tensor.Quantizer``: usages, ``is_quantizable``, ``make_empty``, ``__call__``."""

    STORAGE = QuantizedTensorStorage
    BLOCK = 32

    def __init__(self, *, rowwise=True, columnwise=True):
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def supports_only_rowwise_all_gather(self):
        return False

    def is_quantizable(self, inp):
        return inp.ndim >= 2 and inp.shape[-1] % self.BLOCK == 0 and math.prod(inp.shape[:-1]) % self.BLOCK == 0

    def make_empty(self, shape, dtype=torch.float32, device=None):
        m, k = math.prod(shape[:-1]), shape[-1]
        buffers = {}
        if self.rowwise_usage:
            buffers["rowwise_data"], buffers["rowwise_scale_inv"] = self._buffers(m, k, columnwise=False, device=device)
        if self.columnwise_usage:
            buffers["columnwise_data"], buffers["columnwise_scale_inv"] = self._buffers(
                m, k, columnwise=True, device=device
            )
        return self.STORAGE(shape, dtype, **buffers)

    def __call__(self, tensor):
        out = self.make_empty(list(tensor.shape), tensor.dtype, tensor.device)
        codes = tensor.reshape(-1, tensor.shape[-1]).round().to(torch.uint8)
        if self.rowwise_usage:
            out._rowwise_data.copy_(self._encode(codes, columnwise=False))
            out._rowwise_scale_inv.fill_(1)
        if self.columnwise_usage:
            out._columnwise_data.copy_(self._encode(codes, columnwise=True))
            out._columnwise_scale_inv.fill_(1)
        return out

    def _encode(self, codes, *, columnwise):
        return codes


class MXFP8Quantizer(Quantizer):
    STORAGE = MXFP8TensorStorage

    def _buffers(self, m, k, *, columnwise, device):
        scale = (ru(m // 32, 4), ru(k, 128)) if columnwise else (ru(m, 128), ru(k // 32, 4))
        return (
            torch.empty(m, k, dtype=torch.uint8, device=device),
            torch.empty(scale, dtype=torch.uint8, device=device),
        )


class Float8BlockQuantizer(Quantizer):
    STORAGE = Float8BlockwiseQTensorStorage
    BLOCK = 128
    block_scaling_dim = 1

    def _buffers(self, m, k, *, columnwise, device):
        data = (k, m) if columnwise else (m, k)
        scale = (math.ceil(m / 128), ru(k, 4)) if columnwise else (math.ceil(k / 128), ru(m, 4))
        return (
            torch.empty(data, dtype=torch.uint8, device=device),
            torch.empty(scale, dtype=torch.float32, device=device),
        )

    def _encode(self, codes, *, columnwise):
        return codes.t() if columnwise else codes


class NVFP4Quantizer(Quantizer):
    STORAGE = NVFP4TensorStorage
    BLOCK = 16

    @staticmethod
    def convert_shape_for_fp4(shape):
        return list(shape[:-1]) + [shape[-1] // 2]

    @staticmethod
    def get_columnwise_shape(shape):
        return [shape[-1], math.prod(shape[:-1])]

    def _buffers(self, m, k, *, columnwise, device):
        data = (k, m // 2) if columnwise else (m, k // 2)
        scale = (ru(k, 128), ru(m // 16, 4)) if columnwise else (ru(m, 128), ru(k // 16, 4))
        return (
            torch.empty(data, dtype=torch.uint8, device=device),
            torch.empty(scale, dtype=torch.uint8, device=device),
        )

    def _encode(self, codes, *, columnwise):
        c = codes.t().contiguous() if columnwise else codes
        return c[:, 0::2] | (c[:, 1::2] << 4)

    def __call__(self, tensor):
        out = super().__call__(tensor)
        out._amax_rowwise = out._amax_columnwise = tensor.abs().amax().reshape(1)
        return out
