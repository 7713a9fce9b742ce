# SPDX-License-Identifier: Apache-2.0

LINGBOT_CAMERA_ACTIONS_CONDITION = "camera_actions"
LINGBOT_PROMPT_UPDATED_CONDITION = "lingbot_prompt_updated"

LINGBOT_INTERACTIVE_KV_WINDOW_CACHE = "lingbot_interactive_kv_window"
LINGBOT_C2WS_PLUCKER_EMB_CACHE = "lingbot_c2ws_plucker_emb"
LINGBOT_CAM_CONDITIONER_CACHE = "lingbot_cam_conditioner"
LINGBOT_ROPE_CACHE = "lingbot_rope"
LINGBOT_SEQUENCE_SHARD_ROPE_CACHE = "lingbot_sequence_shard_rope"
LINGBOT_TIME_EMBEDDINGS_CACHE = "lingbot_time_embeddings"
