"""Tiny models shared by the test modules (built in code, random weights, CPU)."""
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel


def tiny_h3_transformer(num_layers: int, num_refiner_layers: int = 2, head_dim: int = 32, rope_freq_dim: int = 4):
    """A MiniMax-H3 transformer with 2 heads of `head_dim` (6 x rope_freq_dim rotary channels: 24 by
    default) and one packed request of 3 text, 8 video and 2 audio rows, as (model, forward kwargs)."""
    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=head_dim, hidden_size=48, num_layers=num_layers,
        num_refiner_layers=num_refiner_layers, ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=16,
        freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=rope_freq_dim).eval()
    video, audio, text = 8, 2, 3
    s = video + audio + text
    inputs = dict(
        hidden_states=torch.randn(1, video, 16), audio_hidden_states=torch.randn(1, audio, 4),
        encoder_hidden_states=torch.randn(1, text, 16), timestep=torch.tensor([0.5]),
        timestep_indices=torch.zeros(s, dtype=torch.long),
        token_tags=torch.tensor([1] * text + [0] * video + [2] * audio),
        position_ids=torch.stack([torch.arange(s), torch.arange(s) % 2, torch.arange(s) % 4], dim=1),
        text_indices=torch.arange(text), video_indices=torch.arange(text, text + video),
        audio_indices=torch.arange(text + video, s), return_dict=False)
    return model, inputs
