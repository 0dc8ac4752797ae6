"""torchtitan models for tests/test_torchtitan.py: the integration's small Llama 3 with a
mistake a user makes in its config-declared sharding."""

from tpdp_verify.integrations import torchtitan as tt


def llama3_ffn_without_sp():
    """The small Llama 3 under sequence parallel with each block's feed-forward declared as
    without it (``set_dense_ffn_sharding(enable_sp=False)``): a block left behind when SP was
    turned on. Its input, a sequence shard, is declared replicated."""
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, set_dense_ffn_sharding

    config = tt.config()
    for layer in config.layers:
        set_dense_ffn_sharding(layer.feed_forward, attn_x_layout=dense_activation_placement(tp=spmd.I),
                               enable_sp=False)
    model = config.build()
    model.init_states()
    return model
