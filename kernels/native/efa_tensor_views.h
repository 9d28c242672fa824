// efa_tensor_views.h: tensors over one allocation, for the C++ extensions (efa_gda_op.cpp,
// efa_proxy_op.cpp): an op's outputs and scratch made from one at::empty instead of one each;
// and their check of where a tensor lies.
#pragma once

#include <torch/extension.h>

namespace efa_views {

// A tensor of `dtype` (sizes, strides) over the bytes of `buf`'s storage from `byte_off` on, made
// as one TensorImpl: no allocation and no dispatcher call, which several at::empty and views cost
// per call. The tensors carved out of one allocation keep all of it alive; an op's are used
// together (its outputs, its handle's layout). `byte_off` is a multiple of dtype's size.
inline at::Tensor carve(const at::Tensor &buf, at::ScalarType dtype, at::IntArrayRef sizes,
                        at::IntArrayRef strides, int64_t byte_off) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(buf.storage()), buf.key_set(), caffe2::TypeMeta::fromScalarType(dtype));
    impl->set_sizes_and_strides(sizes, strides,
                                (buf.storage_offset() * buf.element_size() + byte_off) /
                                    static_cast<int64_t>(c10::elementSize(dtype)));
    return at::Tensor(std::move(impl));
}

// Whether `a` lies on CUDA device `device` (-2: a CPU tensor, the tests' stand-in device), 16-byte
// aligned: the planned calls' check of a tensor's place (it only decides; the caller's checked
// path names anything else).
inline bool on(const at::Tensor &a, int64_t device) {
    const bool here = device == -2 ? a.is_cpu() : a.is_cuda() && a.get_device() == device;
    return here && (reinterpret_cast<uintptr_t>(a.data_ptr()) & 15) == 0;
}

// n rounded up to 256 bytes (each carved tensor starts 256-byte aligned, as at::empty's do).
inline int64_t up256(int64_t n) { return (n + 255) & ~int64_t(255); }

}  // namespace efa_views
