"""Batch-invariant bf16 (--batch-invariant): the same greedy tokens for a prompt whatever shares its steps, however
its prompt is chunked, whether its prefix came from the cache, and with speculation or without.

On the default path kvyard's bf16 kernels choose their blocking by the shape of each call (oneDNN, MKL, AMX), and
a prompt's attention runs through SDPA over its chunk while a decode's runs through the paged kernel, so a row's
rounding depends on its neighbours. The batch-invariant path keeps every weight plain for one portable kernel
(RowInvariantWeight) and attends every token as a decode row (AttentionMetadata.invariant_rows). On AVX512-BF16
CPUs without AMX the default path already is that path for a dense bf16 model, and the engine turns it on by
default there (kvyard/models/invariance.py).
"""

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.errors import InvalidRequestError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.attention import AttentionMetadata, PrefillSpan
from kvyard.models.linear import RowInvariantLowBit, RowInvariantWeight
from kvyard.quant.qlinear import VnniLowBitLinear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="kvyard's C++ kernels did not build here")
# Where the default kernels keep each row's sums in one order, so that batch invariance is on by default
FREE_HERE = cpu_kernels.available() and cpu_kernels.dpbf16_available() and not cpu_kernels.amx_available()

OUTPUT_TOKENS = 128
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how books "
        "were made, how ideas moved between cities, and who could read them. Scholars still argue about which "
        "workshop came first, but the records of guilds, paper mills and merchants tell a story of many hands. ")


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    """`count` different prompts of mixed lengths (about 20 to 200 tokens), cut from a repeated text."""
    ids = llm.tokenizer.encode(TEXT * 6)
    return [ids[(7 * i) % 50 : (7 * i) % 50 + 20 + (53 * i) % 180] for i in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = OUTPUT_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def invariant_llm(smollm2_path):
    llm = LLM(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="256MiB",
              enable_prefix_caching=False)
    yield llm
    llm.close()


def test_a_row_of_a_matmul_is_the_same_alone_and_among_others():
    torch.manual_seed(0)
    w = RowInvariantWeight((torch.randn(200, 576) / 24).to(torch.bfloat16))
    x = torch.randn(300, 576).to(torch.bfloat16)
    alone = w(x[5:6])
    for rows in (2, 7, 32, 65, 300):  # the few-row path, past it, and a prefill-sized call
        assert torch.equal(w(x[5 - min(5, rows - 1) : 5 - min(5, rows - 1) + rows])[min(5, rows - 1)], alone[0])


def test_invariant_rows_give_each_prompt_token_its_own_context():
    bs = 4
    decode_blocks = torch.tensor([[7, 3]])
    # a decode row (context 6), a whole 3-token prompt in block 2, and a 2-token chunk after 9 cached tokens
    meta = AttentionMetadata(slot_mapping=torch.tensor([13, 8, 9, 10, 21, 22]), block_size=bs, num_decodes=1,
                             decode_blocks=decode_blocks, decode_lens=torch.tensor([6]),
                             prefills=[PrefillSpan(1, 4, None, None),
                                       PrefillSpan(4, 6, torch.tensor([0, 1, 2, 3, 16, 17, 18, 19, 20, 21, 22]),
                                                   torch.ones(2, 11, dtype=torch.bool))])
    rows = meta.invariant_rows()
    assert rows.num_decodes == 6 and rows.decode_lens.tolist() == [6, 1, 2, 3, 10, 11]
    assert rows.decode_blocks.tolist() == [[7, 3, 0], [2, 0, 0], [2, 0, 0], [2, 0, 0], [0, 4, 5], [0, 4, 5]]
    assert meta.invariant_rows() is rows  # once per step, for every layer


def test_the_path_refuses_what_it_does_not_cover():
    from kvyard.config import EngineConfig

    for options in (dict(dtype="float32"), dict(quantization="int8"), dict(tensor_parallel_size=2),
                    dict(kv_cache_dtype="int8")):
        with pytest.raises(InvalidRequestError, match="batch_invariant does not cover"):
            EngineConfig(batch_invariant=True, **options)


def test_by_default_it_is_on_exactly_where_the_default_kernels_keep_a_rows_order(invariant_llm, smollm2_path):
    """On such a CPU the default engine gives the invariant engine's tokens: cold, chunked, among others."""
    prompts = _prompts(invariant_llm, 7)
    with LLM(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory="64MiB", max_num_batched_tokens=45,
             enable_prefix_caching=False) as default:
        assert default.engine.batch_invariant == FREE_HERE
        if FREE_HERE:
            assert _greedy(default, prompts)[6] == _greedy(invariant_llm, prompts[6:7])[0]


@pytest.mark.parametrize(("options", "free"), [
    (dict(dtype="float32"), False),  # exact, but not the bf16 path
    # GGUF's own blocks: free where the AVX-512 low-bit kernel takes every row count through its bf16 tiles
    (dict(dtype="bfloat16", quantization="gguf"), FREE_HERE and cpu_kernels.vnni_lowbit_available()),
])
def test_by_default_it_is_off_where_it_costs_or_does_not_apply(smollm2_path, options, free):
    with LLM(model=str(smollm2_path), kv_cache_memory="32MiB", **options) as llm:
        assert llm.engine.batch_invariant is free


def test_a_lora_adapter_turns_the_default_off_and_is_refused_when_asked_for(smollm2_path, tmp_path):
    import peft
    import transformers

    from kvyard.errors import ConfigError

    hf_config = transformers.AutoConfig.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])  # random base weights: only shapes matter
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(hf_config), lora).save_pretrained(tmp_path)
    adapter = str(tmp_path)
    with LLM(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory="32MiB") as default:
        assert default.engine.batch_invariant == FREE_HERE
        default.engine.load_lora("a", adapter)
        assert default.engine.batch_invariant is False and default.engine.runner.model.batch_invariant is False
    with LLM(model=str(smollm2_path), dtype="bfloat16", kv_cache_memory="32MiB", batch_invariant=True) as asked:
        with pytest.raises(ConfigError, match="batch_invariant does not cover LoRA adapters"):
            asked.engine.load_lora("a", adapter)
        assert asked.engine.batch_invariant is True


def test_a_prompt_gives_the_same_tokens_alone_and_in_batches_of_2_7_and_32(invariant_llm):
    prompts = _prompts(invariant_llm, 32)
    alone = _greedy(invariant_llm, prompts[:1])[0]
    assert len(alone) == OUTPUT_TOKENS
    for size in (2, 7):
        assert _greedy(invariant_llm, prompts[:size])[0] == alone, f"in a batch of {size}"
    batch = _greedy(invariant_llm, prompts)
    assert batch[0] == alone, "in a batch of 32"
    # and a prompt other than the first, alone against its place in the batch of 32 (mixed lengths around it)
    assert _greedy(invariant_llm, prompts[19:20])[0] == batch[19]


@pytest.mark.parametrize("budget", [16, 45])  # on the default path both changed the tokens here
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(invariant_llm, smollm2_path, budget):
    prompt = _prompts(invariant_llm, 30)[29]  # the longest: ~200 tokens
    whole = _greedy(invariant_llm, [prompt])[0]
    with LLM(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB",
             max_num_batched_tokens=budget) as chunked:
        assert _greedy(chunked, [prompt])[0] == whole


def test_a_prefix_cache_hit_gives_the_tokens_of_a_cold_run(invariant_llm, smollm2_path):
    prompts = _prompts(invariant_llm, 30)
    cold = _greedy(invariant_llm, [prompts[29]])[0]
    with LLM(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB",
             enable_prefix_caching=True) as cached:
        first = _greedy(cached, [prompts[29]])[0]
        hits = cached.engine.blocks.hit_tokens
        again = _greedy(cached, [prompts[29]])[0]
        assert cached.engine.blocks.hit_tokens > hits  # the second run read its prefix from the cache
    assert first == cold and again == cold


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(invariant_llm, smollm2_path):
    prompt = invariant_llm.tokenizer.encode(TEXT * 3)  # repeats itself: prompt lookup finds drafts
    plain = _greedy(invariant_llm, [prompt])[0]
    with LLM(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB",
             speculative_method="ngram") as spec:
        assert _greedy(spec, [prompt])[0] == plain
        assert spec.engine.spec.stats.accepted_tokens > 0  # drafts were verified and taken, not skipped


@pytest.mark.slow  # two engines; make test is near its time limit (n-gram and prefix-cache cases stay)
def test_draft_model_speculation_gives_the_tokens_of_plain_decoding(invariant_llm, smollm2_path):
    prompt = _prompts(invariant_llm, 30)[11]
    plain = _greedy(invariant_llm, [prompt])[0]
    with LLM(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB",
             speculative_method="draft", speculative_model=str(smollm2_path)) as spec:
        assert _greedy(spec, [prompt])[0] == plain
        assert spec.engine.spec.stats.accepted_tokens > 0


@pytest.mark.slow  # two engines; make test is near its time limit (n-gram and prefix-cache cases stay)
def test_kv_handed_over_from_a_prefill_engine_gives_the_colocated_tokens(invariant_llm, smollm2_path):
    from kvyard.disagg.blocks import gather_blocks

    prompt = _prompts(invariant_llm, 30)[29]
    colocated = _greedy(invariant_llm, [prompt])[0]
    options = dict(model=str(smollm2_path), dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB")
    with LLM(**options, max_num_batched_tokens=45) as prefill, LLM(**options) as decode:
        eng = prefill.engine
        rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True)
        while eng.has_unfinished_requests():
            eng.step()
        held, bs = eng.held[rid], eng.cfg.block_size
        usable = (len(prompt) - 1) // bs
        tensors = gather_blocks(eng.runner.kv_caches, held.block_ids[:usable], bs)
        assert decode.engine.adopt_kv(held.token_ids[: usable * bs], held.block_hashes[:usable], tensors) == usable
        assert _greedy(decode, [prompt])[0] == colocated
        assert decode.engine.blocks.hit_tokens == usable * bs  # the handed-over blocks were used, not recomputed


def test_gguf_blocks_give_a_prompts_tokens_alone_in_a_chunked_batch_and_from_the_cache(smollm2_path):
    """--quantization gguf: SmolLM2's own Q4_1 blocks at every row count through the AVX-512 low-bit kernel's bf16
    tiles where it runs without AMX, else through the portable low-bit kernel."""
    options = dict(model=str(smollm2_path), dtype="bfloat16", quantization="gguf", batch_invariant=True,
                   kv_cache_memory="64MiB")
    with LLM(**options, enable_prefix_caching=False) as whole:
        qkv = whole.engine.runner.model.layers[0].qkv
        tiles = cpu_kernels.vnni_lowbit_available() and not cpu_kernels.amx_available()
        assert isinstance(qkv, VnniLowBitLinear if tiles else RowInvariantLowBit)
        x = torch.randn(9, qkv.in_features).to(torch.bfloat16)
        assert torch.equal(qkv(x[4:5])[0], qkv(x)[4])  # one row as it is among nine
        prompts = _prompts(whole, 7)
        alone = _greedy(whole, prompts[6:7])[0]
    with LLM(**options, max_num_batched_tokens=45, enable_prefix_caching=True) as chunked:
        in_batch = _greedy(chunked, prompts)[6]  # cold, chunked by the 45-token budget, among 6 others
        again = _greedy(chunked, prompts[6:7])[0]  # its prefix from the cache
    assert in_batch == alone and again == alone


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_qwen25_coder_gives_a_prompts_batch_tokens_alone_and_from_the_cache(quantization):
    """Qwen2.5-Coder-0.5B: 14 heads over 2 KV heads, biased q/k/v, a 151,936-token head; fetches 491 MB. Dense
    bf16 and the file's own low-bit blocks."""
    from kvyard.loader.registry import resolve_model

    with LLM(model=str(resolve_model("qwen2.5-coder-0.5b")), dtype="bfloat16", batch_invariant=True,
             quantization=quantization, kv_cache_memory="256MiB", max_num_batched_tokens=100) as llm:
        prompts = _prompts(llm, 7)
        in_batch = _greedy(llm, prompts)  # cold, in a batch of 7, prompts chunked by the 100-token budget
        hits = llm.engine.blocks.hit_tokens
        alone = _greedy(llm, prompts[6:7])[0]  # alone, its prefix from the cache
        assert llm.engine.blocks.hit_tokens > hits
    assert alone == in_batch[6]
