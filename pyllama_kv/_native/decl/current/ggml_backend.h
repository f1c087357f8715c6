/* pyllama_kv's declarations from the current pin's ggml-backend.h (included by llama.h): the backend
 * registry, through which pk.Model(..., rpc=[...]) finds ggml's RPC backend, as
 * common/arg.cpp add_rpc_devices does, and pk.Model finds out whether a GPU is there (its default
 * n_gpu_layers). Exported by libggml-base, which every libllama links.
 * Read by pyllama_kv/_native/ffi.py with cffi in ABI mode; tests/test_ffi_header.py compiles them
 * against the vendored headers, so any drift fails a test. */
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
