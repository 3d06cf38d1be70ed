from grpo_pipeline.cli import main

main()
