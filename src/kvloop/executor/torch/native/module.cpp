// Python bindings of kvloop's CPU kernels.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "out (+)= x @ W.T (+ bias), W in 4 bits",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
        py::arg("out"), py::arg("accumulate"));
  m.def("decode_attention", &decode_attention, "one-token attention over paged KV in place",
        py::arg("q"), py::arg("cache"), py::arg("block_table"), py::arg("context_lens"),
        py::arg("scale"), py::arg("out"));
}
