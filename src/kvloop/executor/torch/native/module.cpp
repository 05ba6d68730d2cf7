// Python bindings of kvloop's CPU kernels.
#include <torch/extension.h>

#include "kernels.h"

// NOTE: the kernels touch only tensor memory: they release the GIL, so that the server's
// event loop (another thread) keeps serving while a long step runs.
static const auto kFree = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_available", &bf16_available, "whether bf16_linear runs here");
  m.def("amx_available", &amx_available,
        "whether bf16_linear and q4_linear multiply with AMX here");
  m.attr("AMX_ROWS") = kAmxRows;
  m.attr("AMX_Q4_ROWS") = kAmxQ4Rows;
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<std::vector<at::Tensor>>, std::vector<std::optional<at::Tensor>>,
                    int64_t, int64_t, int64_t, int64_t>(),
           py::arg("norms"), py::arg("kinds"), py::arg("weights"), py::arg("biases"),
           py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"))
      .def("run", &DecodeLayers::run,
           "a decode step's layers on its token ids and positions; returns x", kFree,
           py::arg("ids"), py::arg("embed"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("positions"), py::arg("caches"), py::arg("slots"), py::arg("block_table"),
           py::arg("context_lens"), py::arg("eps"), py::arg("scale"))
      .def_property_readonly("threads", &DecodeLayers::threads,
                             "the threads that ran the last call (1: no team)")
      .def_readonly_static("BF16", &DecodeLayers::kBf16)
      .def_readonly_static("Q4", &DecodeLayers::kQ4)
      .def_readonly_static("F32", &DecodeLayers::kF32);
  m.def("argmax_rows", &argmax_rows, "each row's argmax over its first columns (a list)",
        kFree, py::arg("logits"), py::arg("columns"));
}

// The kernels a model's layers call, as torch operators ``torch.ops.kvloop.<name>``: the
// schema says which arguments each one writes (``(a!)``), so torch.compile and the profiler
// see them as ops (their shape functions, which write nothing, are registered in Python).
// NOTE: torch releases the GIL while an operator runs, as kFree does for the bindings above.
TORCH_LIBRARY(kvloop, m) {
  m.def("q4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? bias, "
        "Tensor(a!) out, bool accumulate) -> ()");
  m.def("q8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, Tensor(a!) out, "
        "bool accumulate) -> ()");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out, "
        "bool accumulate) -> ()");
  m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out, "
        "bool accumulate) -> ()");
  m.def("decode_attention(Tensor q, Tensor cache, Tensor block_table, Tensor context_lens, "
        "float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention(Tensor q, Tensor cache, Tensor block_table, Tensor starts, "
        "Tensor context_lens, float scale, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) cache, "
        "Tensor slots, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvloop, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("f32_linear", &f32_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("silu_mul", &silu_mul);
}
