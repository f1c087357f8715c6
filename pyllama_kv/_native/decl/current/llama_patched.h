/* pyllama_kv's declarations from the current pin's llama.h: functions only its patch series
 * (patches/current/) adds. Read by pyllama_kv/_native/ffi.py with cffi in ABI mode;
 * tests/test_ffi_header.py compiles them against vendor/llama.cpp-current's (patched) llama.h. */
size_t llama_state_seq_add_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
bool llama_memory_update(struct llama_context * ctx);
size_t llama_state_seq_get_size_range(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
size_t llama_state_seq_get_data_range(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
