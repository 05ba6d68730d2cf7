// Python bindings of kvloop's CPU kernels.
#include <torch/extension.h>

#include "kernels.h"

// NOTE: the kernels touch only tensor memory: they release the GIL, so that the server's
// event loop (another thread) keeps serving while a long step runs.
static const auto kFree = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "out (+)= x @ W.T (+ bias), W in 4 bits", kFree,
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
        py::arg("out"), py::arg("accumulate"));
  m.def("q8_linear", &q8_linear, "out (+)= x @ W.T (+ bias), W in 8 bits", kFree,
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"),
        py::arg("out"), py::arg("accumulate"));
  m.def("bf16_linear", &bf16_linear, "out (+)= x @ W.T (+ bias), W and x in bfloat16", kFree,
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"), py::arg("accumulate"));
  m.def("f32_linear", &f32_linear, "out (+)= x @ W.T (+ bias), W and x in float32", kFree,
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"), py::arg("accumulate"));
  m.def("bf16_available", &bf16_available, "whether bf16_linear runs here");
  m.def("amx_available", &amx_available,
        "whether bf16_linear and q4_linear multiply with AMX here");
  m.attr("AMX_ROWS") = kAmxRows;
  m.attr("AMX_Q4_ROWS") = kAmxQ4Rows;
  m.def("decode_attention", &decode_attention, "one-token attention over paged KV in place",
        kFree, py::arg("q"), py::arg("cache"), py::arg("block_table"),
        py::arg("context_lens"), py::arg("scale"), py::arg("out"));
  m.def("prefill_attention", &prefill_attention,
        "causal attention of prefill chunks over paged KV in place", kFree, py::arg("q"),
        py::arg("cache"), py::arg("block_table"), py::arg("starts"), py::arg("context_lens"),
        py::arg("scale"), py::arg("out"));
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm, fused", kFree, py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("out"));
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k in place, k and v into the cache",
        kFree, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("cache"),
        py::arg("slots"), py::arg("num_heads"), py::arg("num_kv_heads"));
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
  m.def("silu_mul", &silu_mul, "silu(gate) * up", kFree, py::arg("gate_up"), py::arg("out"));
}
