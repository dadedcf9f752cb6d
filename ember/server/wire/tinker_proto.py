"""The Tinker public protobuf schema (``tinker_public.proto``), in a private descriptor pool.

The serialized descriptor is copied from the ``tinker`` SDK 0.38.0 (Apache-2.0,
``tinker/proto/tinker_public_pb2.py``; the schema is written out in ``shared/spec/tinker_api.md``
Appendix A). It is loaded into a pool of our own so the API process neither imports the SDK (which
pulls in torch) nor clashes with it when both live in one process (tests).
"""

from __future__ import annotations

from google.protobuf import descriptor_pool, message_factory

_SERIALIZED = (
    b'\n\x13tinker_public.proto\x12\rtinker_public"\x9c\x03\n\x0eSampleResponse\x121\n\tsequences\x18'
    b'\x01 \x03(\x0b2\x1e.tinker_public.SampledSequence\x12\x1c\n\x0fprompt_logprobs\x18\x02 \x01(\x0c'
    b'H\x00\x88\x01\x01\x12>\n\x14topk_prompt_logprobs\x18\x03 \x01(\x0b2\x1b.tinker_public.TopkLogpro'
    b'bsH\x01\x88\x01\x01\x12\x1f\n\x17prompt_cache_hit_tokens\x18\x04 \x01(\x05\x12:\n\x16target_prom'
    b'pt_logprobs\x18\x05 \x01(\x0b2\x15.tinker_public.TensorH\x02\x88\x01\x01\x12>\n\x11prompt_alt_to'
    b'kens\x18\x06 \x01(\x0b2\x1e.tinker_public.PromptAltTokensH\x03\x88\x01\x01B\x12\n\x10_prompt_log'
    b'probsB\x17\n\x15_topk_prompt_logprobsB\x19\n\x17_target_prompt_logprobsB\x14\n\x12_prompt_alt_to'
    b'kens"a\n\x0fPromptAltTokens\x12%\n\x06tokens\x18\x01 \x01(\x0b2\x15.tinker_public.Tensor\x12\'\n'
    b'\x08logprobs\x18\x02 \x01(\x0b2\x15.tinker_public.Tensor"\xd0\x01\n\x0fSampledSequence\x12.\n'
    b'\x0bstop_reason\x18\x01 \x01(\x0e2\x19.tinker_public.StopReason\x12\x0e\n\x06tokens\x18\x02 \x01'
    b'(\x0c\x12\x15\n\x08logprobs\x18\x03 \x01(\x0cH\x00\x88\x01\x01\x12?\n\x15topk_sampled_logprobs'
    b'\x18\x04 \x01(\x0b2\x1b.tinker_public.TopkLogprobsH\x01\x88\x01\x01B\x0b\n\t_logprobsB\x18\n\x16'
    b'_topk_sampled_logprobs"N\n\x0cTopkLogprobs\x12\x11\n\ttoken_ids\x18\x01 \x01(\x0c\x12\x10\n\x08l'
    b'ogprobs\x18\x02 \x01(\x0c\x12\t\n\x01k\x18\x03 \x01(\r\x12\x0e\n\x06length\x18\x04 \x01(\r"F\n\t'
    b'SparseCsr\x12\x0e\n\x06values\x18\x01 \x01(\x0c\x12\x14\n\x0ccrow_indices\x18\x02 \x01(\x0c\x12'
    b'\x13\n\x0bcol_indices\x18\x03 \x01(\x0c"\x89\x01\n\x06Tensor\x12\x0f\n\x05dense\x18\x01 \x01('
    b'\x0cH\x00\x12.\n\nsparse_csr\x18\x02 \x01(\x0b2\x18.tinker_public.SparseCsrH\x00\x12#\n\x05dtype'
    b'\x18\x03 \x01(\x0e2\x14.tinker_public.DType\x12\r\n\x05shape\x18\x04 \x03(\x03B\n\n\x08encoding"'
    b'k\n\rBatchedTensor\x12\x0c\n\x04data\x18\x01 \x01(\x0c\x12\x0f\n\x07offsets\x18\x02 \x01(\x0c'
    b'\x12#\n\x05dtype\x18\x03 \x01(\x0e2\x14.tinker_public.DType\x12\x16\n\x0etrailing_shape\x18\x04 '
    b'\x03(\x03"\xb8\x01\n\x0bArrayRecord\x12\x10\n\x08type_tag\x18\x01 \x01(\t\x126\n\x06fields\x18'
    b'\x02 \x03(\x0b2&.tinker_public.ArrayRecord.FieldsEntry\x12\x12\n\nnum_datums\x18\x03 \x01(\x03'
    b'\x1aK\n\x0bFieldsEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12+\n\x05value\x18\x02 \x01(\x0b2\x1c.t'
    b'inker_public.BatchedTensor:\x028\x01"\xdd\x01\n\x15ForwardBackwardOutput\x12\x1b\n\x13loss_fn_ou'
    b'tput_type\x18\x01 \x01(\t\x123\n\x0floss_fn_outputs\x18\x02 \x03(\x0b2\x1a.tinker_public.ArrayRe'
    b'cord\x12B\n\x07metrics\x18\x03 \x03(\x0b21.tinker_public.ForwardBackwardOutput.MetricsEntry\x1a.'
    b'\n\x0cMetricsEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12\r\n\x05value\x18\x02 \x01(\x01:\x028\x01'
    b'"\xb8\x03\n\x16ForwardBackwardRequest\x12\x10\n\x08model_id\x18\x01 \x01(\t\x12\x0e\n\x06seq_id'
    b'\x18\x02 \x01(\x05\x12"\n\x04data\x18\x03 \x03(\x0b2\x14.tinker_public.Datum\x12\x0f\n\x07loss_f'
    b'n\x18\x04 \x01(\t\x12O\n\x0eloss_fn_config\x18\x05 \x03(\x0b27.tinker_public.ForwardBackwardRequ'
    b'est.LossFnConfigEntry\x12\x14\n\x0cforward_only\x18\x06 \x01(\x08\x12T\n\x11loss_fn_config_v2'
    b'\x18\x07 \x03(\x0b29.tinker_public.ForwardBackwardRequest.LossFnConfigV2Entry\x1a3\n\x11LossFnCo'
    b'nfigEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12\r\n\x05value\x18\x02 \x01(\x01:\x028\x01\x1aU\n'
    b'\x13LossFnConfigV2Entry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12-\n\x05value\x18\x02 \x01(\x0b2\x1e.'
    b'tinker_public.LossConfigValue:\x028\x01"<\n\x0fLossConfigValue\x12\x10\n\x06number\x18\x01 \x01('
    b'\x01H\x00\x12\x0e\n\x04text\x18\x02 \x01(\tH\x00B\x07\n\x05value"\xb4\x02\n\x05Datum\x12)\n\x0bm'
    b'odel_input\x18\x01 \x03(\x0b2\x14.tinker_public.Chunk\x12>\n\x0eloss_fn_inputs\x18\x02 \x03(\x0b'
    b'2&.tinker_public.Datum.LossFnInputsEntry\x128\n\x11model_input_spans\x18\x03 \x03(\x0b2\x1d.tink'
    b'er_public.ProvenanceSpan\x12:\n\x13loss_fn_input_spans\x18\x04 \x03(\x0b2\x1d.tinker_public.Prov'
    b'enanceSpan\x1aJ\n\x11LossFnInputsEntry\x12\x0b\n\x03key\x18\x01 \x01(\t\x12$\n\x05value\x18\x02 '
    b'\x01(\x0b2\x15.tinker_public.Tensor:\x028\x01"\x96\x01\n\x0eProvenanceSpan\x12<\n\rprompt_tokens'
    b'\x18\x01 \x01(\x0b2#.tinker_public.PromptProvenanceSpanH\x00\x12>\n\x0esampled_tokens\x18\x02 '
    b'\x01(\x0b2$.tinker_public.SampledProvenanceSpanH\x00B\x06\n\x04span"K\n\x14PromptProvenanceSpan'
    b'\x12\x13\n\x0bsequence_id\x18\x01 \x01(\t\x12\x0e\n\x06offset\x18\x02 \x01(\x03\x12\x0e\n\x06len'
    b'gth\x18\x03 \x01(\x03"L\n\x15SampledProvenanceSpan\x12\x13\n\x0bsequence_id\x18\x01 \x01(\t\x12'
    b'\x0e\n\x06offset\x18\x02 \x01(\x03\x12\x0e\n\x06length\x18\x03 \x01(\x03"\x9f\x01\n\x05Chunk\x12'
    b'7\n\x0cencoded_text\x18\x01 \x01(\x0b2\x1f.tinker_public.EncodedTextChunkH\x00\x12*\n\x05image'
    b'\x18\x02 \x01(\x0b2\x19.tinker_public.ImageChunkH\x00\x12(\n\x04dmel\x18\x03 \x01(\x0b2\x18.tink'
    b'er_public.DmelChunkH\x00B\x07\n\x05chunk""\n\x10EncodedTextChunk\x12\x0e\n\x06tokens\x18\x01 '
    b'\x01(\x0c"\xb6\x01\n\nImageChunk\x12\x0c\n\x04data\x18\x01 \x01(\x0c\x12\x0e\n\x06format\x18\x02'
    b' \x01(\t\x12\x1c\n\x0fexpected_tokens\x18\x03 \x01(\x05H\x00\x88\x01\x01\x12@\n\x13override_dime'
    b'nsions\x18\x04 \x01(\x0b2\x1e.tinker_public.ImageDimensionsH\x01\x88\x01\x01B\x12\n\x10_expected'
    b'_tokensB\x16\n\x14_override_dimensions"0\n\x0fImageDimensions\x12\r\n\x05width\x18\x01 \x01(\r'
    b'\x12\x0e\n\x06height\x18\x02 \x01(\r"\x19\n\tDmelChunk\x12\x0c\n\x04dmel\x18\x01 \x01(\x0c"\xa5'
    b'\x02\n\x0eSamplingParams\x12\x17\n\nmax_tokens\x18\x01 \x01(\x05H\x01\x88\x01\x01\x12\x11\n\x04s'
    b'eed\x18\x02 \x01(\x04H\x02\x88\x01\x01\x12\x18\n\x0btemperature\x18\x03 \x01(\x02H\x03\x88\x01'
    b'\x01\x12\x12\n\x05top_k\x18\x04 \x01(\x05H\x04\x88\x01\x01\x12\x12\n\x05top_p\x18\x05 \x01(\x02H'
    b'\x05\x88\x01\x01\x12/\n\tstop_strs\x18\x06 \x01(\x0b2\x1a.tinker_public.StopStringsH\x00\x120\n'
    b'\x0bstop_tokens\x18\x07 \x01(\x0b2\x19.tinker_public.StopTokensH\x00B\x06\n\x04stopB\r\n\x0b_max'
    b'_tokensB\x07\n\x05_seedB\x0e\n\x0c_temperatureB\x08\n\x06_top_kB\x08\n\x06_top_p"\x1d\n\x0bStopS'
    b'trings\x12\x0e\n\x06values\x18\x01 \x03(\t"\x1c\n\nStopTokens\x12\x0e\n\x06values\x18\x01 \x03('
    b'\x05*:\n\nStopReason\x12\x14\n\x10STOP_REASON_STOP\x10\x00\x12\x16\n\x12STOP_REASON_LENGTH\x10'
    b'\x01*g\n\x05DType\x12\x15\n\x11DTYPE_UNSPECIFIED\x10\x00\x12\x11\n\rDTYPE_FLOAT32\x10\x01\x12'
    b'\x0f\n\x0bDTYPE_INT64\x10\x02\x12\x0f\n\x0bDTYPE_INT32\x10\x03\x12\x12\n\x0eDTYPE_BFLOAT16\x10'
    b'\x04b\x06proto3'
)

_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(_SERIALIZED)


def _message(name: str) -> type:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = _message("ForwardBackwardRequest")
ForwardBackwardOutput = _message("ForwardBackwardOutput")
SampleResponse = _message("SampleResponse")
Tensor = _message("Tensor")

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1
