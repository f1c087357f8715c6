/* pyllama_kv's declarations from the current pin's llama.h: functions only its patch series
 * (patches/current/) adds. Read by pyllama_kv/_native/ffi.py with cffi in ABI mode;
 * tests/test_ffi_header.py compiles them against vendor/llama.cpp-current's (patched) llama.h. */
size_t llama_state_seq_add_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
bool llama_memory_update(struct llama_context * ctx);
