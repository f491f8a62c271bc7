from modbench.cli import main

main()
