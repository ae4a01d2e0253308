"""GPTBigCode (StarCoder, SantaCoder): transformers models/gpt_bigcode/modeling_gpt_bigcode.py."""
